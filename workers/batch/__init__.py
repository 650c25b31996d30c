"""The Batch API's runner: batches run line by line through the bus."""
