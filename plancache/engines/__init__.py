"""Building plans: the backend seam, the cuDNN backend (the only module that imports
cuDNN), autotuning (timing and checking candidates) and replay of stored descriptions.

Named ``engines`` because what lives here chooses and builds cuDNN engines; a package
folder named ``build/`` reads as generated output to people and to tools (``.gitignore``,
linters), which then skip it.
"""
