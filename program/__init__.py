"""The top floor: the `tokenway` command (up, each stage, provision, status, dlq, batch,
asyncapi), which builds the stages below it."""
