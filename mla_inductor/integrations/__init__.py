"""Adapters from real model code to :func:`mla_inductor.sparse_mla`; one module per library
(``transformers``, with its chunked DSA indexer in ``transformers_indexer``).

They sit on top of the public API: the package never imports them, so importing
``mla_inductor`` imports none of the libraries they adapt.
"""
