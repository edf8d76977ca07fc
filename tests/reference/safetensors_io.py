"""safetensors files as spmdx writes them (its --debug.dump_initial_weights and `spmdx export`),
read and written with NumPy alone, for the references beside this file: the format's 8-byte
little-endian header length, the JSON header (dtype, shape, data_offsets per tensor), the data."""
import json
import struct

import numpy as np

KINDS = {"F32": np.float32, "F64": np.float64, "I64": np.int64, "I32": np.int32}


def read_safetensors(path):
    """{name: array} of every tensor in the file (views of its bytes, read-only)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        begin, end = t["data_offsets"]
        out[name] = np.frombuffer(data[8 + n + begin : 8 + n + end], dtype=KINDS[t["dtype"]]).reshape(t["shape"])
    return out


def write_safetensors(path, tensors):
    """Writes {name: array} (float32, float64, int64 or int32), the header padded to 8 bytes."""
    kinds = {np.dtype(v): k for k, v in KINDS.items()}
    header, blobs, at = {}, [], 0
    for name, t in tensors.items():
        data = np.ascontiguousarray(t).tobytes()
        header[name] = {"dtype": kinds[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + len(data)]}
        blobs.append(data)
        at += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
