"""Export a GraphSAGE checkpoint's weights as DGL `SAGEConv('mean')` weights in an .npz.

Runs in the main venv (it reads our checkpoint); the DGL baseline loads the .npz in its own env:

    .venv/bin/python bench/baselines/export_weights.py ckpt.pt sage.npz

PyG's `SAGEConv` computes `lin_l(mean_j x_j) + lin_r(x_i)` with the bias in `lin_l` and none in
`lin_r`; DGL 2.x's computes `fc_neigh(mean_j x_j) + fc_self(x_i)` with its one bias in `fc_self`
(`fc_neigh` is bias-free). So `fc_neigh = lin_l.weight`, `fc_self = lin_r.weight` and the bias
`lin_l.bias` goes to `fc_self.bias`: a bias is added once either way.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def sage_to_dgl(state_dict: dict, num_layers: int) -> dict[str, np.ndarray]:
    """Map a `SampledGNN` (kind "sage") state dict to DGL SAGEConv arrays.

    Args:
        state_dict: the model's `state_dict()` (tensors or arrays).
        num_layers: number of convs.

    Returns:
        `{"layer{i}_fc_neigh": (out, in), "layer{i}_fc_self": (out, in), "layer{i}_bias": (out,)}`.
    """

    def arr(key):
        if key not in state_dict:
            raise ValueError(f"state dict has no {key!r}: not a GraphSAGE of {num_layers} layers")
        v = state_dict[key]
        return np.asarray(v.detach().cpu().numpy() if hasattr(v, "detach") else v, np.float32)

    out = {}
    for i in range(num_layers):
        p = f"convs.{i}."
        if p + "lin_r.bias" in state_dict:
            raise ValueError(f"layer {i} has a root bias; DGL SAGEConv has one bias only")
        out[f"layer{i}_fc_neigh"] = arr(p + "lin_l.weight")
        out[f"layer{i}_fc_self"] = arr(p + "lin_r.weight")
        out[f"layer{i}_bias"] = arr(p + "lin_l.bias")
    return out


def export(checkpoint, out_path, fanouts=None) -> dict:
    """Write the .npz for `checkpoint`; returns the config stored with it."""
    from quiver.models import load_checkpoint

    model, ckpt = load_checkpoint(checkpoint)
    if model.cfg.kind != "sage":
        raise ValueError(f"only GraphSAGE maps to DGL SAGEConv; the checkpoint is {model.cfg.kind}")
    fanouts = list(fanouts or ckpt.get("fanouts") or [15, 10, 5])
    cfg = {"kind": model.cfg.kind, "num_layers": model.cfg.num_layers, "fanouts": fanouts}
    arrays = sage_to_dgl(model.state_dict(), model.cfg.num_layers)
    np.savez(out_path, config_json=np.array(json.dumps(cfg)), **arrays)
    return cfg


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="quiver train-model checkpoint (GraphSAGE)")
    p.add_argument("out", help="output .npz")
    args = p.parse_args(argv)
    cfg = export(args.checkpoint, args.out)
    print(f"wrote {args.out}: {cfg}")


if __name__ == "__main__":
    main()
