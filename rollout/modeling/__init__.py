"""The models: resolving and materialising model folders (builtin, Hub cache, GGUF), and nanochat."""
