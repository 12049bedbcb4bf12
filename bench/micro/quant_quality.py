"""What weight-only quantization costs in model quality, on the real model.

    python -m prefixserve.bench.micro.quant_quality          # SmolLM2-135M-Instruct

transformers runs the checkpoint in fp32 three ways: as loaded, and with every linear weight
replaced by its int8 and by its int4 dequantized copy (`workers.models.quantization`: what the
engine's quantized layers compute). Over this repository's docs, cut into ``--window``-token
windows, each quantized model is teacher-forced on the same text as the original: perplexity,
the share of positions where its top-1 token is the original's, and the mean KL divergence of
its next-token distribution from the original's.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer

from prefixserve.bench.load.machine import cpu_name
from prefixserve.workers.checkpoints import DEFAULT_MODEL, resolve_checkpoint
from prefixserve.workers.models.quantization import METHODS

DOCS = Path(__file__).resolve().parents[2] / "docs"


def windows(tokenizer: Tokenizer, size: int, count: int) -> list[list[int]]:
    ids: list[int] = []
    for doc in sorted(DOCS.glob("*.md")):
        ids.extend(tokenizer.encode(doc.read_text()).ids)
    return [ids[i: i + size] for i in range(0, len(ids) - size, size)][:count]


def quantized(model: torch.nn.Module, name: str) -> torch.nn.Module:
    out = copy.deepcopy(model)
    with torch.no_grad():
        for m in out.modules():
            if isinstance(m, torch.nn.Linear) and METHODS[name].packs(m):
                m.weight = torch.nn.Parameter(METHODS[name].pack(m.weight)[2])  # untied
    return out


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--windows", type=int, default=16)
    args = p.parse_args(argv)
    path = resolve_checkpoint(args.model)
    tokenizer = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    base = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    texts = windows(tokenizer, args.window, args.windows)
    ref = [torch.log_softmax(base(torch.tensor([t])).logits[0, :-1], -1) for t in texts]
    print(json.dumps({"cpu": cpu_name(), "model": args.model, "tokens": sum(map(len, texts))}))
    for name in ("none", "int8", "int4"):
        model = base if name == "none" else quantized(base, name)
        nll = agree = kl = n = 0.0
        for t, r in zip(texts, ref, strict=True):
            lp = torch.log_softmax(model(torch.tensor([t])).logits[0, :-1], -1)
            target = torch.tensor(t[1:])
            nll += float(-lp.gather(1, target[:, None]).sum())
            agree += float((lp.argmax(-1) == r.argmax(-1)).sum())
            kl += float((r.exp() * (r - lp)).sum())
            n += len(t) - 1
        print(json.dumps({"quantization": name, "perplexity": round(float(torch.exp(
            torch.tensor(nll / n))), 3), "top1_agreement": round(agree / n, 4),
            "mean_kl": round(kl / n, 5)}), flush=True)


if __name__ == "__main__":
    main()
