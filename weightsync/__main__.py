from weightsync.cli import run

run()
