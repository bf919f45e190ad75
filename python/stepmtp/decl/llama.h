/* The part of vendor/llama.cpp/include/llama.h (and ggml.h) that stepmtp uses, in the
 * syntax cffi's cdef parses. The binding is compiled against the real headers (API
 * mode), so the compiler checks every declaration here; structs end in "...;" so only
 * the fields we touch are named and their layout comes from the real header. */

typedef int32_t llama_pos;
typedef int32_t llama_token;
typedef int32_t llama_seq_id;

struct llama_model;
struct llama_context;
struct llama_vocab;
typedef struct llama_memory_i * llama_memory_t;

enum ggml_log_level {
    GGML_LOG_LEVEL_NONE  = 0,
    GGML_LOG_LEVEL_DEBUG = 1,
    GGML_LOG_LEVEL_INFO  = 2,
    GGML_LOG_LEVEL_WARN  = 3,
    GGML_LOG_LEVEL_ERROR = 4,
    GGML_LOG_LEVEL_CONT  = 5,
};
typedef void (*ggml_log_callback)(enum ggml_log_level level, const char * text, void * user_data);

enum llama_context_type {
    LLAMA_CONTEXT_TYPE_DEFAULT = 0,
    LLAMA_CONTEXT_TYPE_MTP     = 1,
};

enum llama_flash_attn_type {
    LLAMA_FLASH_ATTN_TYPE_AUTO     = -1,
    LLAMA_FLASH_ATTN_TYPE_DISABLED = 0,
    LLAMA_FLASH_ATTN_TYPE_ENABLED  = 1,
};

enum ggml_type {
    GGML_TYPE_F32    = 0,
    GGML_TYPE_F16    = 1,
    GGML_TYPE_Q4_0   = 2,
    GGML_TYPE_Q4_1   = 3,
    GGML_TYPE_Q5_0   = 6,
    GGML_TYPE_Q5_1   = 7,
    GGML_TYPE_Q8_0   = 8,
    GGML_TYPE_IQ4_NL = 20,
    GGML_TYPE_BF16   = 30,
    ...
};
const char * ggml_type_name(enum ggml_type type);

enum llama_split_mode {
    LLAMA_SPLIT_MODE_NONE   = 0,
    LLAMA_SPLIT_MODE_LAYER  = 1,
    LLAMA_SPLIT_MODE_ROW    = 2,
    LLAMA_SPLIT_MODE_TENSOR = 3,
};

enum ggml_numa_strategy {
    GGML_NUMA_STRATEGY_DISABLED   = 0,
    GGML_NUMA_STRATEGY_DISTRIBUTE = 1,
    GGML_NUMA_STRATEGY_ISOLATE    = 2,
    GGML_NUMA_STRATEGY_NUMACTL    = 3,
    ...
};

struct llama_model_tensor_buft_override {
    const char * pattern;
    ggml_backend_buffer_type_t buft;
};

typedef bool (*llama_progress_callback)(float progress, void * user_data);
typedef bool (*ggml_abort_callback)(void * data);

typedef struct llama_batch {
    int32_t n_tokens;
    llama_token  *  token;
    float        *  embd;
    llama_pos    *  pos;
    int32_t      *  n_seq_id;
    llama_seq_id ** seq_id;
    int8_t       *  logits;
} llama_batch;

enum llama_load_mode {
    LLAMA_LOAD_MODE_AUTO       = -1,
    LLAMA_LOAD_MODE_NONE       =  0,
    LLAMA_LOAD_MODE_MMAP       =  1,
    LLAMA_LOAD_MODE_MLOCK      =  2,
    LLAMA_LOAD_MODE_MMAP_MLOCK =  3,
    LLAMA_LOAD_MODE_DIRECT_IO  =  4,
    ...
};

enum llama_rope_scaling_type {
    LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED = -1,
    LLAMA_ROPE_SCALING_TYPE_NONE        = 0,
    LLAMA_ROPE_SCALING_TYPE_LINEAR      = 1,
    LLAMA_ROPE_SCALING_TYPE_YARN        = 2,
    ...
};

enum llama_model_kv_override_type {
    LLAMA_KV_OVERRIDE_TYPE_INT,
    LLAMA_KV_OVERRIDE_TYPE_FLOAT,
    LLAMA_KV_OVERRIDE_TYPE_BOOL,
    LLAMA_KV_OVERRIDE_TYPE_STR,
};

struct llama_model_kv_override {
    enum llama_model_kv_override_type tag;
    char key[128];
    union {
        int64_t val_i64;
        double  val_f64;
        bool    val_bool;
        char    val_str[128];
    };
};

struct llama_model_params {
    ggml_backend_dev_t * devices;
    const struct llama_model_tensor_buft_override * tensor_buft_overrides;
    int32_t n_gpu_layers;
    enum llama_split_mode split_mode;
    int32_t main_gpu;
    const float * tensor_split;
    llama_progress_callback progress_callback;
    void * progress_callback_user_data;
    enum llama_load_mode load_mode;
    bool vocab_only;
    bool check_tensors;
    bool load_mtp;
    /* the server's --override-kv, --repack, --no-host */
    const struct llama_model_kv_override * kv_overrides;
    bool use_extra_bufts;
    bool no_host;
    ...;
};

struct llama_context_params {
    uint32_t n_ctx;
    uint32_t n_batch;
    uint32_t n_ubatch;
    uint32_t n_seq_max;
    uint32_t n_outputs_max;
    int32_t  n_threads;
    int32_t  n_threads_batch;
    enum llama_context_type ctx_type;
    enum llama_flash_attn_type flash_attn_type;
    enum ggml_type type_k;
    enum ggml_type type_v;
    ggml_abort_callback abort_callback;
    void * abort_callback_data;
    bool embeddings;
    bool offload_kqv;
    bool no_perf;
    bool swa_full;
    bool kv_unified;
    int32_t mtp_kv_block;
    /* the server's rope / YaRN flags and --no-op-offload */
    enum llama_rope_scaling_type rope_scaling_type;
    float    rope_freq_base;
    float    rope_freq_scale;
    float    yarn_ext_factor;
    float    yarn_attn_factor;
    float    yarn_beta_fast;
    float    yarn_beta_slow;
    uint32_t yarn_orig_ctx;
    bool     op_offload;
    ...;
};

enum llama_ftype {
    LLAMA_FTYPE_ALL_F32        = 0,
    LLAMA_FTYPE_MOSTLY_F16     = 1,
    LLAMA_FTYPE_MOSTLY_Q4_0    = 2,
    LLAMA_FTYPE_MOSTLY_Q8_0    = 7,
    LLAMA_FTYPE_MOSTLY_Q4_K_M  = 15,
    LLAMA_FTYPE_MOSTLY_Q5_K_M  = 17,
    LLAMA_FTYPE_MOSTLY_Q6_K    = 18,
    LLAMA_FTYPE_MOSTLY_IQ4_XS  = 30,
    LLAMA_FTYPE_MOSTLY_BF16    = 32,
    ...
};

typedef struct llama_model_quantize_params {
    int32_t nthread;
    enum llama_ftype ftype;
    bool allow_requantize;
    bool quantize_output_tensor;
    bool pure;
    ...;
} llama_model_quantize_params;

struct llama_model_quantize_params llama_model_quantize_default_params(void);
uint32_t llama_model_quantize(const char * fname_inp, const char * fname_out, const llama_model_quantize_params * params);

struct llama_model_params   llama_model_default_params(void);
struct llama_context_params llama_context_default_params(void);

void llama_backend_init(void);
void llama_numa_init(enum ggml_numa_strategy numa);
size_t llama_max_devices(void);
void llama_log_set(ggml_log_callback log_callback, void * user_data);
const char * llama_print_system_info(void);
bool llama_supports_gpu_offload(void);
int64_t llama_time_us(void);

struct llama_model * llama_model_load_from_file(const char * path_model, struct llama_model_params params);
void llama_model_free(struct llama_model * model);

struct llama_context * llama_init_from_model(struct llama_model * model, struct llama_context_params params);
void llama_free(struct llama_context * ctx);

uint32_t llama_n_ctx    (const struct llama_context * ctx);
uint32_t llama_n_ctx_seq(const struct llama_context * ctx);
uint32_t llama_n_batch  (const struct llama_context * ctx);
uint32_t llama_n_ubatch (const struct llama_context * ctx);
uint32_t llama_n_seq_max(const struct llama_context * ctx);

llama_memory_t llama_get_memory(const struct llama_context * ctx);
const struct llama_vocab * llama_model_get_vocab(const struct llama_model * model);

int32_t llama_model_n_ctx_train(const struct llama_model * model);
int32_t llama_model_n_embd     (const struct llama_model * model);
int32_t llama_model_n_layer    (const struct llama_model * model);
int32_t llama_model_n_swa      (const struct llama_model * model);
int32_t llama_model_meta_val_str(const struct llama_model * model, const char * key, char * buf, size_t buf_size);
int32_t llama_model_meta_count(const struct llama_model * model);
int32_t llama_model_meta_key_by_index(const struct llama_model * model, int32_t i, char * buf, size_t buf_size);
int32_t llama_model_meta_val_str_by_index(const struct llama_model * model, int32_t i, char * buf, size_t buf_size);
int32_t llama_model_desc(const struct llama_model * model, char * buf, size_t buf_size);
uint64_t llama_model_size(const struct llama_model * model);
uint64_t llama_model_n_params(const struct llama_model * model);
const char * llama_model_chat_template(const struct llama_model * model, const char * name);

typedef struct llama_chat_message {
    const char * role;
    const char * content;
} llama_chat_message;
int32_t llama_chat_apply_template(const char * tmpl, const struct llama_chat_message * chat, size_t n_msg,
                                  bool add_ass, char * buf, int32_t length);
int32_t llama_chat_builtin_templates(const char ** output, size_t len);

void llama_memory_clear(llama_memory_t mem, bool data);

size_t llama_state_seq_get_size(struct llama_context * ctx, llama_seq_id seq_id);
size_t llama_state_seq_get_data(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id);
size_t llama_state_seq_set_data(struct llama_context * ctx, const uint8_t * src, size_t size,
                                llama_seq_id dest_seq_id);
typedef uint32_t llama_state_seq_flags;
size_t llama_state_seq_get_size_ext(struct llama_context * ctx, llama_seq_id seq_id, llama_state_seq_flags flags);
size_t llama_state_seq_get_data_ext(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id,
                                    llama_state_seq_flags flags);
size_t llama_state_seq_set_data_ext(struct llama_context * ctx, const uint8_t * src, size_t size,
                                    llama_seq_id dest_seq_id, llama_state_seq_flags flags);
size_t llama_state_seq_save_file(struct llama_context * ctx, const char * filepath, llama_seq_id seq_id,
                                 const llama_token * tokens, size_t n_token_count);
size_t llama_state_seq_load_file(struct llama_context * ctx, const char * filepath, llama_seq_id dest_seq_id,
                                 llama_token * tokens_out, size_t n_token_capacity, size_t * n_token_count_out);
bool llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
void llama_memory_seq_cp(llama_memory_t mem, llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1);
llama_pos llama_memory_seq_pos_min(llama_memory_t mem, llama_seq_id seq_id);
llama_pos llama_memory_seq_pos_max(llama_memory_t mem, llama_seq_id seq_id);

int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);
struct llama_perf_context_data {
    double t_start_ms;
    double t_load_ms;
    double t_p_eval_ms;
    double t_eval_ms;
    int32_t n_p_eval;
    int32_t n_eval;
    int32_t n_reused;
};
struct llama_perf_context_data llama_perf_context(const struct llama_context * ctx);
void llama_set_n_threads(struct llama_context * ctx, int32_t n_threads, int32_t n_threads_batch);
void llama_synchronize(struct llama_context * ctx);
float * llama_get_logits(struct llama_context * ctx);
float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);

int32_t llama_vocab_n_tokens(const struct llama_vocab * vocab);
const char * llama_vocab_get_text(const struct llama_vocab * vocab, llama_token token);
bool llama_vocab_is_eog(const struct llama_vocab * vocab, llama_token token);
bool llama_vocab_is_control(const struct llama_vocab * vocab, llama_token token);
llama_token llama_vocab_bos(const struct llama_vocab * vocab);
llama_token llama_vocab_eos(const struct llama_vocab * vocab);
llama_token llama_vocab_eot(const struct llama_vocab * vocab);
bool llama_vocab_get_add_bos(const struct llama_vocab * vocab);
bool llama_vocab_get_add_eos(const struct llama_vocab * vocab);

int32_t llama_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len,
                       llama_token * tokens, int32_t n_tokens_max, bool add_special, bool parse_special);
int32_t llama_token_to_piece(const struct llama_vocab * vocab, llama_token token, char * buf,
                             int32_t length, int32_t lstrip, bool special);
int32_t llama_detokenize(const struct llama_vocab * vocab, const llama_token * tokens, int32_t n_tokens,
                         char * text, int32_t text_len_max, bool remove_special, bool unparse_special);

/* the server's --lora / --control-vector */
struct llama_adapter_lora;
struct llama_adapter_lora * llama_adapter_lora_init(struct llama_model * model, const char * path_lora);
void llama_adapter_lora_free(struct llama_adapter_lora * adapter);
int32_t llama_set_adapters_lora(struct llama_context * ctx, struct llama_adapter_lora ** adapters,
                                size_t n_adapters, float * scales);
int32_t llama_set_adapter_cvec(struct llama_context * ctx, const float * data, size_t len, int32_t n_embd,
                               int32_t il_start, int32_t il_end);
