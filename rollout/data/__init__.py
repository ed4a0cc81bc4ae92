"""The prompts: procedural tasks with verifiers, and datasets from files and Hugging Face folders."""
