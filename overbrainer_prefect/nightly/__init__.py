"""A nightly fine-tune's night (core: no Prefect).

- `fingerprint`: what a fine-tune would train, part by part (datasets by
  content or Hub commit, the base model's commit, the settings, the package's
  version), its key, and what changed between two;
- `prepared`: the files a prepare step says it wrote, checked for rows and
  taken as the night's datasets and eval file;
- `record`: each deployment's last delivered and last trained fingerprints;
- `decision`: whether a night trains, and the words that say why.
"""
