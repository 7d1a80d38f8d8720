"""Language-model data: document sources, tokenizers, prepared token files and seeded random windows.

- :mod:`zoo.data.sources`: where documents come from (``python-docs``, ``python-stdlib``, ``files``,
  ``shards``, ``hf``); :mod:`zoo.data.stdlib`: which files of the standard library ``python-stdlib`` reads;
- :mod:`zoo.data.tokenize`: the byte tokenizer (256 byte values + EOS) and Hugging Face tokenizers;
- :mod:`zoo.data.prepare`: ``zoo data prepare`` — a source tokenised once into flat token files
  (``train.bin``, ``val.bin``, ``meta.json``), deterministic and resumable;
- :mod:`zoo.data.windows`: memory-mapped token files and the seeded random windows training draws.
- :mod:`zoo.data.root`: where prepared data lives (``task.data_dir``, ``$ZOO_DATA_DIR``, the user's cache).
"""
