"""Evaluation: how well an autoencoder reconstructs held-out text, and what its latent space is like.

- :mod:`.totals`: the statistics vector of a forward (loss sum, tokens, correct tokens, exact
  samples, samples), summed over batches and data-parallel ranks, and the numbers it gives;
- :mod:`.records`: each sample as the model saw it beside its reconstruction; :mod:`.bleu`: corpus
  BLEU of the reconstructions;
- :mod:`.scoring`: the one loop that scores samples, and whom the scored samples are shared by;
- :mod:`.latent_space`: the latents' size, per-feature statistics (:class:`~.latent_space.LatentStats`,
  which checkpoints record) and how well they survive noise;
- :mod:`.held_out`: the evaluation of a loaded autoencoder in one process (``parallel-latent
  evaluate``, ``save-pretrained``);
- :mod:`.periodic`: the trainer's evaluation over its data-parallel ranks, reading the typed view
  :class:`~.periodic.EvaluatedRun` that the trainer builds. It writes nothing into the model: the
  latents' statistics it measures stay with it, and the trainer's checkpointer passes them to each save.

Nothing here is imported at package import: the API needs the records and the statistics without
the evaluation loops. No module of ``parallel/``, ``model/`` or ``checkpoint/`` imports this package.
"""
