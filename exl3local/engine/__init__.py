"""The vLLM engine child process: its command line, its supervision, its log and its numbers."""
