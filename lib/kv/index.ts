export * from './layout';
export * from './tp';
export * from './descs';
export * from './stats';
export * from './puller';
export * from './prefill';
export * from './metrics';
