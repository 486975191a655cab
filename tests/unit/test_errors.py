"""The one listing helper behind every "first N problems ... and N more" message."""

from moetune.errors import LISTED, listing


def test_listing_shows_the_first_and_counts_the_rest():
    items = [f"p{i}" for i in range(LISTED + 3)]
    lines = listing(items)
    assert lines.startswith("\n  - p0\n  - p1") and lines.endswith(f"\n  - p{LISTED - 1}\n  ... and 3 more")
    assert listing(["a", "b"], inline=True) == "a, b"
    assert listing(items, inline=True).endswith(f"p{LISTED - 1}, ... and 3 more")
    assert listing(["row 0: bad"], total=5) == "\n  - row 0: bad\n  ... and 4 more"  # the caller kept one
