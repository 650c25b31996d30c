"""Dead letters: the mover stage, which copies a message whose deliveries ran out to
`TW_DLQ`."""
