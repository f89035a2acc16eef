"""List the ONNX operators, opset and I/O types of a bundle's step graph (needs ``onnx``).

    python samples/jetson/list_ops.py BUNDLE [--json]

Compare the list with the TensorRT ONNX parser's operator table for the TensorRT of your
JetPack (README.md in this folder records the check for the graphs mars-export writes).
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from runtime.bundle import BundleError, load_config
from runtime.command_line import ArgumentParser, run_main


def graph_ops(path: Path) -> dict:
    """{"opsets", "ops": {op: count}, "inputs": {name: type}, "outputs": {...}} of one ONNX file."""
    model = onnx.load(str(path), load_external_data=False)
    ops = collections.Counter(node.op_type for node in model.graph.node)
    for function in model.functions:  # ops inside local functions, if the exporter left any
        ops.update(node.op_type for node in function.node)
    def kind(v):
        return onnx.TensorProto.DataType.Name(v.type.tensor_type.elem_type).lower()
    return {"opsets": {o.domain or "ai.onnx": o.version for o in model.opset_import},
            "ops": dict(sorted(ops.items())),
            "inputs": {v.name: kind(v) for v in model.graph.input},
            "outputs": {v.name: kind(v) for v in model.graph.output}}


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    config = load_config(args.bundle)  # a path that is no bundle: one error line (run_main)
    onnx_path = Path(args.bundle) / config.onnx_file
    if not onnx_path.is_file():
        raise BundleError(f"{onnx_path} not found; re-export the bundle with mars-export")
    info = graph_ops(onnx_path)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{args.bundle}: dtype {config.dtype}, opsets {info['opsets']}")
    print("ops: " + ", ".join(f"{op} x{n}" for op, n in info["ops"].items()))
    types = collections.Counter(info["inputs"].values()) + collections.Counter(info["outputs"].values())
    print("I/O types: " + ", ".join(f"{t} x{n}" for t, n in sorted(types.items())))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
