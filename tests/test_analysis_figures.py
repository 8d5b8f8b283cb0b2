"""save_figure, the one writer of every figure (claims, per-layer calibration, sensitivity, the calibration
benchmark): PNG and PDF, byte-reproducible, atomic, and the figure closed afterwards."""

import matplotlib.pyplot as plt
import pytest

from kvcert.analysis.figures import save_figure


def _figure():
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1, 2], [1, 0, 2], label="a line")
    ax.legend()
    return fig


def test_png_and_pdf_are_the_same_bytes_on_every_run(tmp_path):
    first = save_figure(_figure(), tmp_path / "a" / "f.png")
    second = save_figure(_figure(), tmp_path / "b" / "f.png", tmp_path / "b" / "elsewhere.pdf")
    assert first == [tmp_path / "a" / "f.png", tmp_path / "a" / "f.pdf"]
    assert second == [tmp_path / "b" / "f.png", tmp_path / "b" / "elsewhere.pdf"]
    for a, b in zip(first, second):
        assert a.read_bytes() == b.read_bytes(), a.name
    assert first[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and first[1].read_bytes()[:5] == b"%PDF-"
    # what would differ between runs or machines is absent: the PDF's date and both files' software string
    for path in first:
        assert b"CreationDate" not in path.read_bytes() and b"Matplotlib v" not in path.read_bytes()
    assert plt.get_fignums() == []  # both figures were closed


def test_a_failed_write_leaves_no_file_and_closes_the_figure(tmp_path):
    fig = _figure()
    (tmp_path / "blocker").write_text("a file where a folder must be")
    with pytest.raises(OSError):
        save_figure(fig, tmp_path / "blocker" / "f.png")
    assert not list(tmp_path.glob("blocker*/*"))
    assert fig.number not in plt.get_fignums()
