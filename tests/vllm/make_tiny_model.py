"""Build a tiny random-weight Llama model directory that vLLM can serve on the CPU.

Run with the vLLM venv's python (it needs torch and transformers):

    python tests/vllm/make_tiny_model.py --tokenizer-dir "$(tokenway model-dir)" --out DIR

The tokenizer, its chat template and the generation config come from `--tokenizer-dir` (the
bundled DeepSeek-V4 tokenizer directory); `config.json` describes a one-layer Llama with
hidden size 64; the weights are drawn with a fixed seed and saved as safetensors, so the same
inputs always give the same directory. The directory is written beside `--out` and renamed
into place; an existing one is left alone.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from model_cli import staged

SEED = 1234
# Copied as they are: the tokenizer, its chat template (in tokenizer_config.json), EOS/BOS.
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
MAX_POSITIONS = 32768  # room for a request long enough to outlast any test


def tiny_config(vocab_size: int, bos: int, eos: int) -> dict[str, object]:
    """A one-layer Llama: two heads of 32 (the CPU attention backend's smallest head size).

    `initializer_range` is large so that random logits stand far apart: greedy decoding then
    picks the same token however the engine batches, which the consistency test relies on.
    """
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "initializer_range": 0.5,
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }


def build(tokenizer_dir: Path, out: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    source = json.loads((tokenizer_dir / "config.json").read_text())
    config = tiny_config(source["vocab_size"], source["bos_token_id"], source["eos_token_id"])
    with staged(out) as tmp:
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(LlamaConfig(**config)).to(torch.float32).eval()
        model.save_pretrained(tmp, safe_serialization=True)
        # save_pretrained writes config.json and generation_config.json in its own words:
        # ours (and the tokenizer directory's) replace them.
        for name in COPIED:
            shutil.copyfile(tokenizer_dir / name, tmp / name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if (args.out / "model.safetensors").is_file():
        print(f"tiny model: {args.out} (already built)")
        return
    print(f"tiny model: {build(args.tokenizer_dir, args.out)}")


if __name__ == "__main__":
    main()
