"""The language: ``.shard`` text to the IR.

* :mod:`~shardspec.frontend.parse`: the lark LALR parser over ``grammars/shardspec.lark``
  (package data ``shardspec.grammars``) and the transformer into IR.
* :mod:`~shardspec.frontend.syntax_errors`: a syntax error as an ``SS001`` diagnostic, with
  a hint for the usual mistakes.
* :mod:`~shardspec.frontend.ir`: the IR, frozen dataclasses with a source span on every node.
"""
