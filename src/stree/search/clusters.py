"""Diversity clusters for ETS: agglomerative clustering of step embeddings on cosine distance."""
import numpy as np


def cluster_embeddings(embeddings, distance_threshold=0.3, linkage="average"):
    """Cluster labels (list of ints from 0) of embeddings (n, dim) by agglomerative clustering on cosine
    distance, cutting the dendrogram at `distance_threshold` (0 = identical directions, 2 = opposite)."""
    from scipy.cluster.hierarchy import fcluster, linkage as build_linkage
    from scipy.spatial.distance import pdist

    points = np.asarray(embeddings, dtype=np.float64)
    if points.ndim != 2 or points.shape[0] == 0:
        raise ValueError(f"embeddings must be (n >= 1, dim), got shape {points.shape}")
    if points.shape[0] == 1:
        return [0]
    distances = np.clip(pdist(points, metric="cosine"), 0.0, 2.0)
    labels = fcluster(build_linkage(distances, method=linkage), t=distance_threshold, criterion="distance")
    first_seen = {}
    return [first_seen.setdefault(label, len(first_seen)) for label in labels]
