"""Weight shapes (K = in_features, N = out_features; y = x @ W) from the seed model tables."""

SHAPES = {
    "qwen3_gate_up": (2048, 5120),
    "qwen3_down": (5120, 2048),
    "qwen3_q": (2048, 4096),
    "qwen3_o": (4096, 2048),
    "glm47_shared_gate_up": (2048, 10240),
    "glm47_shared_down": (10240, 2048),
    "llama3_8b_gate_up": (4096, 14336),
    "llama3_8b_down": (14336, 4096),
    "llama3_70b_gate_up": (8192, 28672),
    "llama3_70b_down": (28672, 8192),
}
M_VALUES = (1, 4, 16, 32, 64, 128, 512, 4096)
BITS = (2, 3, 4, 5)
