"""How DCP saves and loads are planned across ranks: linear in the rank count, cached across saves of one layout.

Each module is imported where it is used; the package re-exports nothing. ``planning`` holds the planners
(``LinearSavePlanner``; ``LocalLoadPlanner``, whose read items are found in one pass over the saved chunks), its
dedup and checks are ``plan_checks``; each rank's items are sent as columns (``plan_columns``: one item list its
peers share and an array of their offsets and sizes, planned in numpy), the large parts ``packed`` (unpickled once
per distinct one); the write results go back by ``plan_results``, as columns too (``result_columns``), written into
the ``.metadata`` as they came (``fastio.metapickle``). Used by ``formats.sharded``; below it are ``fastio`` and
``formats.safe_load``.
"""
