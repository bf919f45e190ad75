/* patches/0004-mtp-c-api.patch: include/llama-mtp.h, the plain C API for the MTP heads. */

int32_t llama_mtp_model_n_blocks(const struct llama_model * model);
int32_t llama_mtp_model_n_blocks_loaded(const struct llama_model * model);
int32_t llama_mtp_model_n_layer_trunk(const struct llama_model * model);
int32_t llama_mtp_set_layer_offset(struct llama_context * ctx, int32_t offset);
int32_t llama_mtp_get_layer_offset(const struct llama_context * ctx);
void    llama_mtp_set_embeddings_nextn(struct llama_context * ctx, bool value, bool masked);
float * llama_mtp_get_embeddings_nextn(struct llama_context * ctx);
float * llama_mtp_get_embeddings_nextn_ith(struct llama_context * ctx, int32_t i);
void    llama_mtp_context_memory(const struct llama_context * ctx, size_t * kv, size_t * compute, size_t * output);
/* patches/0012-batch-invariant-graph.patch */
void    llama_mtp_set_batch_invariant(struct llama_context * ctx, int32_t max_rows);
/* patches/0017-mtp-draft-vocab.patch */
int32_t llama_mtp_set_draft_vocab(struct llama_context * ctx, int32_t n);
