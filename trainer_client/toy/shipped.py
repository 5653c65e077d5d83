"""Where the toy's shipped warm-start weights live (package data): written by
``python -m trainer_client.toy.model --train``, copied into every model directory by
``build_toy``. A module of its own so that neither of those two imports the other for it."""

from pathlib import Path

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"

#: The calculator variant's weights (a 21-token vocabulary with the tool-call characters),
#: written by ``python -m trainer_client.toy.calculator --train``.
CALCULATOR_WEIGHTS_DIR = Path(__file__).resolve().parent / "calculator_weights"
