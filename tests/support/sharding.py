"""Split a one-file checkpoint into several safetensors shards with an index, as hub repos ship."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file


def shard_checkpoint(source: Path, dest: Path, n_shards: int = 2) -> Path:
    """Copy `source` to `dest` with model.safetensors split into `n_shards` files; returns `dest`."""
    dest.mkdir(parents=True)
    with safe_open(source / "model.safetensors", framework="pt") as handle:
        names = sorted(handle.keys())
        tensors = {name: handle.get_tensor(name) for name in names}
    shard_names = [f"model-{i:05d}-of-{n_shards:05d}.safetensors" for i in range(1, n_shards + 1)]
    weight_map = {}
    for index, shard in enumerate(shard_names):
        chunk = names[index::n_shards]
        save_file({name: tensors[name] for name in chunk}, str(dest / shard), metadata={"format": "pt"})
        weight_map.update({name: shard for name in chunk})
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for item in source.iterdir():
        if item.name not in ("model.safetensors", "SHA256SUMS"):
            shutil.copy2(item, dest / item.name)
    sums = []
    for path in sorted(dest.iterdir()):
        with open(path, "rb") as handle:
            sums.append(f"{hashlib.file_digest(handle, 'sha256').hexdigest()}  {path.name}\n")
    (dest / "SHA256SUMS").write_text("".join(sums))
    return dest
