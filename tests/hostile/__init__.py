"""The hostile-folder corpus: every verb against crafted folders, each run in a limited child process."""
