"""Model definitions and HF checkpoint loading, split into an attention part and an expert part."""
