"""The capacity notebook executes headless (nbclient) on the committed sample record."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.notebook

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "capacity_tuning.ipynb"


def test_capacity_notebook_runs() -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent.parent)}}).execute()
    outputs = "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                      for o in cell.get("outputs", []))
    assert "router_max_queued_requests" in outputs and "peak_qps" in outputs
    assert "max_texts_in_flight" in outputs and "text knee" in outputs  # the embedding stage
