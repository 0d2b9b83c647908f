"""Tensor-parallel plans for Hugging Face GPT-2 and Llama (filled in by the HF part of the chapter)."""
