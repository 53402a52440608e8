"""Settings shared by the multi-host test and its worker processes.

Small enough to compile few programs: one token bucket (16; the 25-31-token prompts are prefilled
in chunks beside decodes) and one row bucket (4, all four prompts in one batch)."""

ENGINE_KW = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=64,
                 compilation_cache_dir=None)
PROMPTS = [list(range(5 + i, 30 + 3 * i)) for i in range(4)]
MAX_TOKENS = 10
