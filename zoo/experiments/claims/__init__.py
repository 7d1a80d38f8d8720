"""The claims ledger: published claims, the committed tables that test them, and a verdict computed by rule.

``claims.yaml`` (repository root) defines the ledger as data; ``zoo claims`` regenerates ``CLAIMS.md``,
``tables/README.md`` and the README's results table from it and the committed ``tables/*/results.jsonl``, and
``zoo claims --check`` fails when a committed file differs from the regenerated text. One module per concern:

- :mod:`.schema`: claims.yaml read and checked, a claim bound to the cells and rule it names;
- :mod:`.cells`: the rows of a table's cell over its seeds, checked, and their statistics;
- :mod:`.conditions`: the language of a rule's conditions, and their evaluation on cell means or per seed;
- :mod:`.guard`: the learned guard, every judged cell above its table's no-learning level on every seed;
- :mod:`.changes`: a claim about a change (length, budget, size) states it and does not hold without it;
- :mod:`.verdicts`: the verdict pipeline (seeds, learning, rule, step 0, pre-registration, staleness);
- :mod:`.render`: CLAIMS.md and the README's results table;
- :mod:`.costs`: tables/README.md, the command behind each table and the estimated cost of re-running it;
- :mod:`.ledger`: the entry points, build, write and check;
- :mod:`.errors`: :class:`ClaimsError`, raised as one line naming the place.
"""
