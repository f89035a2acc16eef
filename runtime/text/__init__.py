"""Text in and out: the bundle's tokenizer and chat template (:mod:`.tokenizer`), and the
incremental detokenizer with stop strings (:mod:`.detokenize`)."""
