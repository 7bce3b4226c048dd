from fastfill.cli import run

run()
