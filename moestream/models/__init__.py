"""Model families, one file per Hugging Face `model_type`. Importing this package loads no torch code."""

SUPPORTED_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "deepseek_v3", "glm4_moe_lite", "gemma4_text", "gemma4", "kimi_k25", "gpt_oss", "minimax_m2", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
