"""The papers behind fastcl's methods, as BibTeX: the one place the ``citation`` of the
sentence-transformers losses (:mod:`fastcl.integrations.sentence_transformers`) reads them;
sentence-transformers puts it in the model card of every model the trainer saves."""

from __future__ import annotations

SIMCSE = """
@inproceedings{gao2021simcse,
    title={SimCSE: Simple Contrastive Learning of Sentence Embeddings},
    author={Gao, Tianyu and Yao, Xingcheng and Chen, Danqi},
    booktitle={EMNLP},
    year={2021}
}
"""

DCLR = """
@inproceedings{zhou2022debiased,
    title={Debiased Contrastive Learning of Unsupervised Sentence Representations},
    author={Zhou, Kun and Zhang, Beichen and Zhao, Wayne Xin and Wen, Ji-Rong},
    booktitle={ACL},
    year={2022}
}
"""

FOCAL = """
@inproceedings{hou2023focal,
    title={Improving Contrastive Learning of Sentence Embeddings with Focal-InfoNCE},
    author={Hou, Pengyue and Li, Xingyu},
    booktitle={Findings of EMNLP},
    year={2023}
}
"""

ESCL = """
@inproceedings{liu2023equivariant,
    title={Equivariant Contrastive Learning for Sentence Embeddings},
    author={Liu, Jiahao and others},
    booktitle={ICASSP},
    year={2023}
}
"""

# Cached two-pass encoding (the trainer's --mini-batch-size, the Cached* losses).
GIST = """
@article{solatorio2024gistembed,
    title={GISTEmbed: Guided In-sample Selection of Training Negatives for Text Embedding Fine-tuning},
    author={Solatorio, Aivin V.},
    journal={arXiv preprint arXiv:2402.16829},
    year={2024}
}
"""

GRADCACHE = """
@inproceedings{gao2021scaling,
    title={Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup},
    author={Gao, Luyu and Zhang, Yunyi and Han, Jiawei and Callan, Jamie},
    booktitle={Proceedings of the 6th Workshop on Representation Learning for NLP},
    year={2021}
}
"""

# Each trainer method: (its name, its paper, the paper's BibTeX).
METHODS = {
    "simcse": ("SimCSE (unsupervised)", "Gao et al., EMNLP 2021", SIMCSE),
    "simcse-sup": ("SimCSE (supervised)", "Gao et al., EMNLP 2021", SIMCSE),
    "dclr": ("DCLR", "Zhou et al., ACL 2022", DCLR),
    "focal": ("Focal-InfoNCE", "Hou & Li, Findings of EMNLP 2023", FOCAL),
    "escl": ("ESCL", "Liu et al., ICASSP 2023", ESCL),
}


def citation(method: str) -> str:
    """The BibTeX of ``method``'s paper (a key of :data:`METHODS`)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    return METHODS[method][2]
