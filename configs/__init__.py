"""The shipped configs, installed as package data of ``maskgrpo_ray.configs`` (pyproject's
package-dir maps this folder there): ``maskgrpo train --config toy`` reads ``toy.yaml`` here, in a
checkout and in a pip install alike; ``maskgrpo configs list`` shows them. No code lives here."""
