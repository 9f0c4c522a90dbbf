"""The default model (SmolLM2-135M-Instruct, imported from its GGUF) for tests.

The test command fetches it before pytest runs; a missing one is fetched here.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from foundation.modelstore import resolve_model

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU does in one sentence.",
    "List three colors of the rainbow.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "Give me a tip for learning to code.",
]


@cache
def default_model_dir() -> Path:
    return resolve_model("default")


@cache
def chat_prompts() -> list[list[int]]:
    """The questions through the model's chat template, as HF transformers renders them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    return [
        list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                     tokenize=True, return_dict=True)["input_ids"])
        for q in QUESTIONS
    ]


MAX_NEW = 64
EOS = 2  # <|im_end|>


@cache
def hf_model() -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()


@cache
def hf_greedy() -> list[list[int]]:
    """HF `generate`, greedy, one chat prompt at a time (no padding), stopping at EOS."""
    import torch

    outs = []
    for prompt in chat_prompts():
        with torch.no_grad():
            ids = hf_model().generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW,
                                      do_sample=False, eos_token_id=EOS, pad_token_id=EOS)
        outs.append(ids[0, len(prompt):].tolist())
    return outs
