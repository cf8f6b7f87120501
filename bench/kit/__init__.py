"""What the bench scripts share: their output lines, side-by-side timings, a
private Prefect server and process accounting. A package, so that `make
bench` (which runs `bench/*.py`) never runs it as a script."""
