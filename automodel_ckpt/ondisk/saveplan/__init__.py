"""How DCP saves and loads are planned across ranks: linear in the rank count, cached across saves of one layout.

Each module is imported where it is used; the package re-exports nothing."""
