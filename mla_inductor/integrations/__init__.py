"""Adapters from real model code to :func:`mla_inductor.sparse_mla`: one package per library
(:mod:`.transformers`, with one module per model family inside).

They sit on top of the public API: the package never imports them, so importing
``mla_inductor`` imports none of the libraries they adapt.
"""
