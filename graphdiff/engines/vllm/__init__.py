"""vLLM behind the engine interface (engine.py): its start (start.py, cpu.py, options.py), its capture in this process
(capture.py) or every rank's (tp.py, tp_worker.py), sampling (session.py), and the capture in a child process
(process.py)."""
