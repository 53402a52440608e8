"""Settings shared by the multi-host test and its worker processes."""

ENGINE_KW = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=64,
                 compilation_cache_dir=None)
PROMPTS = [list(range(5 + i, 30 + 3 * i)) for i in range(4)]
MAX_TOKENS = 10
