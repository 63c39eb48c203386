"""Public data from the package registries: pretraining corpus, PTB, Brown, polarity.

Submodules: :mod:`.fetch` (download helpers), :mod:`.corpus` (prose corpus),
:mod:`.ptb`, :mod:`.brown`, :mod:`.polarity` (benchmarks), :mod:`.synthetic`
(a generated corpus, ``elmo-pretrain synthetic``: no download) and :mod:`.cli`
(``fetch-*`` subcommands).
"""
