"""``sf://`` in the URL handling of libraries that do not go through fsspec's registry alone.

- :mod:`sfstore.integrations.webdataset_gopen`: webdataset's ``gopen`` handler for ``sf://`` (registered when
  :mod:`sfstore.fs` is imported, before or after webdataset).
- :mod:`sfstore.integrations.upath`: universal_pathlib's ``UPath`` class for ``sf://`` (found through the
  ``universal_pathlib.implementations`` entry point, without importing sfstore first).

Each module imports its library only when that library is in use, and :mod:`sfstore.fs` only when a path is
opened, so importing sfstore never imports webdataset (which imports torch) or universal_pathlib.
"""
