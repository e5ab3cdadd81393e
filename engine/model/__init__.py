"""The golden DeepSeek-V4.1 text model: plain PyTorch with the reference's numerics (the test oracle)."""
