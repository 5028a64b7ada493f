"""Notebook 01's exercise: predict the bytes an MLP saves for backward."""

import torch

from ...measure import SavedActivations
from ...model import MLP, preset
from .common import exercise


@exercise
def check_mlp_saved_bytes(mlp_saved_bytes) -> bool:
    """01: ``mlp_saved_bytes(batch_size, seq_len, hidden, intermediate, bytes_per_value)`` must predict the
    bytes the course's SwiGLU MLP saves for backward, given an input that requires grad. Checked against a
    measurement (SavedActivations) at several shapes and two precisions."""

    trials = [(2, 8, 16, 32, torch.float32), (3, 5, 64, 96, torch.bfloat16), (1, 1, 16, 8, torch.float32),
              (4, 16, 32, 128, torch.bfloat16)]
    for batch_size, seq_len, hidden, intermediate, dtype in trials:
        mlp = MLP(preset("tiny", hidden=hidden, intermediate=intermediate)).to(dtype)
        x = torch.randn(batch_size, seq_len, hidden, dtype=dtype, requires_grad=True)
        with SavedActivations(mlp) as saved:
            mlp(x)
        e = x.element_size()
        try:
            answer = mlp_saved_bytes(batch_size, seq_len, hidden, intermediate, e)
        except NotImplementedError:
            print("Not done yet: replace `raise NotImplementedError` with your formula, then run this cell again.")
            return False
        if answer != saved.bytes:
            shape = f"batch {batch_size}, seq {seq_len}, hidden {hidden}, intermediate {intermediate}, {e} bytes/value"
            print(f"✗ for {shape}: you predicted {answer}, measured {saved.bytes} bytes")
            tokens = batch_size * seq_len
            if answer == 4 * tokens * intermediate * e:
                print("  hint: the input x is saved too (gate_proj and up_proj both need it: one storage)")
            elif answer == tokens * hidden * e + 3 * tokens * intermediate * e:
                print("  hint: down_proj saves its own input, silu(gate)·up: a fourth b·s·intermediate tensor")
            elif answer == 2 * tokens * hidden * e + 4 * tokens * intermediate * e:
                print("  hint: gate_proj and up_proj save the same x: count that storage once")
            return False
    print(f"✓ correct at all {len(trials)} shapes: b·s·h·e for the input, 4·b·s·I·e for gate, up, silu(gate), "
          "silu(gate)·up")
    return True
