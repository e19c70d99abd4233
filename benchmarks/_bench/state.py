"""The state the save benchmarks write: a GPT-like training state of a chosen size."""

from __future__ import annotations

from typing import Any

import torch


def gpt_state(gib: float, seed: int = 0, *, device: torch.device | str = "cpu", max_d: int = 1024,
              max_layers: int = 24) -> dict[str, Any]:
    """A GPT-like training state of about ``gib`` GiB on ``device``: fp32 parameters plus Adam's
    two moments.

    Parameters are a few large matrices (embeddings, attention and MLP weights) and many small
    vectors (biases, layer norms); the optimizer state mirrors them, as Adam's state_dict does.
    Layers are ``max_d`` wide (narrower for small states), at most ``max_layers`` of them; the
    embedding takes what is left.
    """
    total = int(gib * (1 << 30))
    param_bytes = total // 3
    d = max_d
    while d > 64 and 12 * d * d * 4 > param_bytes // 2:  # small states: narrower layers
        d //= 2
    per_layer = 12 * d * d * 4
    layers = max(1, min(max_layers, param_bytes // per_layer))
    vocab = max(1024, (param_bytes - layers * per_layer) // (d * 4))
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device)

    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(n, device=device)

    model: dict[str, torch.Tensor] = {"wte.weight": randn(vocab, d)}
    for i in range(layers):
        p = f"h.{i}."
        model[p + "ln_1.weight"] = ones(d)
        model[p + "ln_1.bias"] = zeros(d)
        model[p + "attn.c_attn.weight"] = randn(d, 3 * d)
        model[p + "attn.c_attn.bias"] = randn(3 * d)
        model[p + "attn.c_proj.weight"] = randn(d, d)
        model[p + "attn.c_proj.bias"] = randn(d)
        model[p + "ln_2.weight"] = ones(d)
        model[p + "ln_2.bias"] = zeros(d)
        model[p + "mlp.c_fc.weight"] = randn(d, 4 * d)
        model[p + "mlp.c_fc.bias"] = randn(4 * d)
        model[p + "mlp.c_proj.weight"] = randn(4 * d, d)
        model[p + "mlp.c_proj.bias"] = randn(d)
    model["ln_f.weight"] = ones(d)
    model["ln_f.bias"] = zeros(d)
    optim_state = {
        i: {"step": torch.tensor(100.0), "exp_avg": randn(*t.shape) * 1e-3,
            "exp_avg_sq": torch.rand(t.shape, generator=g, device=device) * 1e-6}
        for i, t in enumerate(model.values())
    }
    optim = {
        "state": optim_state,
        "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
                          "params": list(range(len(model)))}],
    }
    return {"model": model, "optim": optim, "step": 100}


def tensor_bytes(obj: object) -> int:
    """Bytes of the distinct tensor storages in ``obj`` (dicts, lists and tuples walked)."""
    seen: set[int] = set()
    total = 0

    def walk(o: object) -> None:
        nonlocal total
        if isinstance(o, torch.Tensor):
            s = o.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    return total
