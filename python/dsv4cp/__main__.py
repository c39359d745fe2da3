from dsv4cp.cli import run

run()
