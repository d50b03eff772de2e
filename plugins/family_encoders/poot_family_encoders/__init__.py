"""poot-family-encoders: BERT, RoBERTa and XLM-RoBERTa encoders for embeddings and reranking."""
