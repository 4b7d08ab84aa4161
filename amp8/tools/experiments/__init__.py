"""Experiments that compare opt levels on real data: a byte corpus, a GPT and a Llama,
one run's training (``train``), the runner (``compare``) and its runs paired by seed
(``paired``), and an outlier stress case (``stress``) that one scale per tensor cannot hold.

Nothing here is imported by ``import amp8``; ``amp8.compare`` loads it on first use.
"""
