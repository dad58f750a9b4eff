"""Questions of the combining chapter: combining the five axes (notebook 07_combining).

``mesh`` (where a rank sits in the mesh), ``numbers`` (chips, memory, what crosses nodes),
``layout`` (pick (d, t, p) by the rules), ``placement`` (a rank's ep group under each
placement of ep; the cp axis's bytes in a 4-D run).
"""

from __future__ import annotations

from parlib.course.questions.ch07 import layout, mesh, numbers, placement
from parlib.course.questions.ch07.layout import PICK_HARDWARE, PICK_MODEL, pick_layout_problems
from parlib.course.questions.ch07.mesh import MESH_SOLUTION, expected_position

__all__ = ["MESH_SOLUTION", "PICK_HARDWARE", "PICK_MODEL", "expected_position", "layout", "mesh",
           "numbers", "pick_layout_problems", "placement"]
