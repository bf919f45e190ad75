/* The part of ggml-backend.h and ggml-rpc.h that stepmtp uses: the device registry,
 * through which RPC servers' devices are obtained and handed to llama.cpp per model
 * (llama_model_params.devices), and the devices' buffer types, named by -ot / -dev. The RPC functions themselves are reached through the
 * RPC registry's get_proc_address, as llama.cpp does, so nothing here needs the RPC
 * backend to be built. */

typedef struct ggml_backend_reg * ggml_backend_reg_t;
typedef struct ggml_backend_device * ggml_backend_dev_t;
typedef struct ggml_backend_buffer_type * ggml_backend_buffer_type_t;

enum ggml_backend_dev_type {
    GGML_BACKEND_DEVICE_TYPE_CPU,
    GGML_BACKEND_DEVICE_TYPE_GPU,
    GGML_BACKEND_DEVICE_TYPE_IGPU,
    GGML_BACKEND_DEVICE_TYPE_ACCEL,
    ...
};

ggml_backend_reg_t ggml_backend_reg_by_name(const char * name);
const char *       ggml_backend_reg_name(ggml_backend_reg_t reg);
size_t             ggml_backend_reg_dev_count(ggml_backend_reg_t reg);
ggml_backend_dev_t ggml_backend_reg_dev_get(ggml_backend_reg_t reg, size_t index);
void *             ggml_backend_reg_get_proc_address(ggml_backend_reg_t reg, const char * name);

size_t             ggml_backend_dev_count(void);
ggml_backend_dev_t ggml_backend_dev_get(size_t index);
const char *       ggml_backend_dev_name(ggml_backend_dev_t device);
const char *       ggml_backend_dev_description(ggml_backend_dev_t device);
void               ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total);
enum ggml_backend_dev_type ggml_backend_dev_type(ggml_backend_dev_t device);
ggml_backend_dev_t ggml_backend_dev_by_name(const char * name);
ggml_backend_dev_t ggml_backend_dev_by_type(enum ggml_backend_dev_type type);
ggml_backend_buffer_type_t ggml_backend_dev_buffer_type(ggml_backend_dev_t device);
const char *       ggml_backend_buft_name(ggml_backend_buffer_type_t buft);

#define RPC_PROTO_MAJOR_VERSION ...
#define RPC_PROTO_MINOR_VERSION ...
