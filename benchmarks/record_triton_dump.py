"""Record a Triton-backend TORCH_COMPILE_DEBUG dump on a GPU, for the dump reader's fixture.

    python benchmarks/record_triton_dump.py --out DIR

The GPU machine has no vLLM, so the compiled program is the seeded tiny Qwen3 in Hugging Face code under
torch.compile (Inductor, Triton backend), inference only. Keeps, per compiled graph, the three files the
dump reader needs (fx_graph_transformed.py, output_code.py, the provenance JSON) under
DIR/torchinductor/<graph>/, with the site-packages prefix replaced by `SITE/`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import tempfile
from pathlib import Path

KEEP = ("fx_graph_transformed.py", "output_code.py", "inductor_provenance_tracking_node_mappings.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    debug = Path(tempfile.mkdtemp(prefix="gd-dump-"))
    os.environ.update(TORCH_COMPILE_DEBUG="1", TORCH_COMPILE_DEBUG_DIR=str(debug))
    import torch
    import torch._inductor.config as inductor_config

    from graphdiff.capture.hf import load_hf_model
    from graphdiff.models.tiny import make_tiny

    inductor_config.trace.provenance_tracking_level = 1
    model = load_hf_model(make_tiny("qwen3", debug / "model")).cuda()
    ids = torch.tensor([[17, 912, 33, 1500, 7, 256, 1024, 3, 88, 640, 1999, 5, 42, 9, 77, 1200]]).cuda()
    with torch.no_grad():
        torch.compile(model)(input_ids=ids, use_cache=False)
    site = re.compile(r"/[^\s\"']*?/(?:site|dist)-packages/")
    for graph in sorted({p.parent for p in debug.rglob("output_code.py")}):
        dest = args.out / "torchinductor" / graph.name
        dest.mkdir(parents=True, exist_ok=True)
        for name in KEEP:
            if (graph / name).is_file():
                (dest / name).write_text(site.sub("SITE/", (graph / name).read_text()))
        print(dest, sorted(p.name for p in dest.iterdir()))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    shutil.rmtree(debug, ignore_errors=True)


if __name__ == "__main__":
    main()
