"""The decoding core (MARS, arXiv 2604.07023, §3; DESIGN.md §3-4): no model code, no I/O.

    params      DecodeParams (per request) and GenerationResult; tau's one check
    acceptance  the acceptance rules: threshold (confidence > tau) and verify (drafts == argmax)
    sampling    greedy / sampled token choice and its confidence
    lookup      prompt-lookup drafts (n-gram index)
    sequence    one request's state
    scheduler   waiting queue, KV slots, and each step's plan (rows, widths, block boundaries)
    kv_cache    the slot KV cache
    batch       the step graph's input arrays (window mask, positions)
    reads       what a step reads: each row's read positions; ids, the confidence gate or logits
    admission   what the engine admits: prompt ids, batch size, slot length, where adaptive masks act; SettingError
                (a bad engine or backend setting, named by its field)
    engine      Engine.step: schedule, run, accept, commit
    decoder     Decoder: one prompt through the engine
"""
