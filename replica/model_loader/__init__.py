"""Where models come from (registry names, GGUF files, HF folders) and how their weights load."""
