"""Adapters from real model code to :func:`mla_inductor.sparse_mla`; one module per library
(``transformers``, with its DSA indexer on :func:`mla_inductor.lightning_indexer` in
``transformers_indexer`` and the opt-in indexer loss in ``transformers_indexer_loss``).

They sit on top of the public API: the package never imports them, so importing
``mla_inductor`` imports none of the libraries they adapt.
"""
